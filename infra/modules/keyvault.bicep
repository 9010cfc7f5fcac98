// Optional Key Vault (RBAC mode) for database URLs. The app reads them through Key Vault
// references in its app settings, resolved with its user-assigned identity (Key Vault Secrets
// User, granted in rbac.bicep). Secrets can be written here at deploy time from the @secure()
// databaseUrlSecrets parameter, or later with `az keyvault secret set`.

@description('Key Vault name (3-24 characters).')
@minLength(3)
@maxLength(24)
param name string

@description('Azure region.')
param location string

@description('Tags applied to the vault.')
param tags object = {}

@description('Purge protection: on by default. A vault with it cannot be purged, so its name stays taken for softDeleteRetentionInDays after deletion.')
param enablePurgeProtection bool = true

@description('Days a deleted vault or secret can be recovered.')
@minValue(7)
@maxValue(90)
param softDeleteRetentionInDays int = 90

@secure()
@description('Secrets to write: {"<secret-name>": "<database URL>"}. Never returned in outputs.')
param secrets object = {}

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' = {
  // checkov:skip=CKV_AZURE_109: the template has no VNet integration, so the Flex Consumption app resolves Key Vault references over the public endpoint; access is RBAC-only
  // checkov:skip=CKV_AZURE_189: same reason as CKV_AZURE_109; add a private endpoint and VNet integration to close it
  // checkov:skip=CKV_AZURE_42: purge protection is on by default through the enablePurgeProtection parameter (ARM rejects an explicit false, so the value is conditional)
  // checkov:skip=CKV_AZURE_110: purge protection is on by default through the enablePurgeProtection parameter (ARM rejects an explicit false, so the value is conditional)
  name: name
  location: location
  tags: tags
  properties: {
    tenantId: subscription().tenantId
    sku: {
      family: 'A'
      name: 'standard'
    }
    enableRbacAuthorization: true
    enableSoftDelete: true
    softDeleteRetentionInDays: softDeleteRetentionInDays
    enablePurgeProtection: enablePurgeProtection ? true : null
    publicNetworkAccess: 'Enabled'
    networkAcls: {
      bypass: 'AzureServices'
      defaultAction: 'Allow'
    }
  }
}

resource secret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' = [for item in items(secrets): {
  // checkov:skip=CKV_AZURE_41: database URLs rotate with the database credential, not on a calendar; with Entra auth they hold no password at all
  parent: vault
  name: item.key
  properties: {
    value: item.value
    contentType: 'text/plain; database URL (SQLAlchemy)'
  }
}]

output name string = vault.name
output id string = vault.id
output uri string = vault.properties.vaultUri
